"""The one place pyroute2 is imported: the rtnetlink socket (routes, links, qdiscs) and the
network-namespace helpers the agent's routes and the testbed use. A change of netlink library,
or of its version's names, is this file."""
from pyroute2 import IPRoute, netns
from pyroute2.netlink.rtnl import TC_H_ROOT

__all__ = ["IPRoute", "TC_H_ROOT", "netns"]
