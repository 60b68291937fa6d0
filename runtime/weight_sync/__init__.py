"""Trainer -> rollout weight broadcast: manifest planning, the process group, bucketed transfer."""
