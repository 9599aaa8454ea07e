"""The one A/B driver: arms, arm order and fresh compose servers (arms), the command (cli)."""
