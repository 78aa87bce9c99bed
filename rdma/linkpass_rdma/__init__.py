"""RDMA-facing parts of LinkPass: verbs (pyverbs) probes and QP steering, the NCCL net plugin.

Import name `linkpass_rdma` (not `rdma`) so it cannot collide with other packages.
"""
