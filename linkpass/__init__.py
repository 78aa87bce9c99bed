"""LinkPass: network-level link failover for AI-training fabrics."""

__version__ = "0.1.0"
