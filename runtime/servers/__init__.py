"""HTTP servers of the rollout and teacher roles (wire protocol: docs/servers.md)."""
