"""The processes a job runs: `kubedistill role trainer|rollout|teacher` (one role of a pod),
`kubedistill run` (every role on one machine) and `kubedistill quickstart`."""
