"""What crosses a process boundary: the rollout/teacher HTTP shapes (protocol), the driver ->
trainer batch (batch) and the dtype table both ends of a weight sync share (dtypes)."""
