"""The host agent: detection and failover (issue 4). Pieces land here as they are built."""
