"""Is this host (or this network namespace) ready for the LinkPass agent?

Every check is a row: ok / warn / fail / skip, a one-line detail, and a fix an on-call engineer
can type. Two layers:

- `gather()` reads the system into a `Facts` record (sysctls, capabilities, `ip -j` output, the
  RDMA sysfs tree, adjtimex, the agent's local API). With `--netns NAME` everything network
  related is read inside that namespace: /proc/sys/net from a thread that entered it
  (linkpass.kernel.netns), `ip -n NAME`, and the agent API over a socket made there.
- `run_checks(facts)` is pure: it turns facts into rows. Unit tests feed it fake facts.

What each check reads:

    sysctl.multipath_hash   net.ipv4.fib_multipath_hash_policy (+ fib_multipath_hash_fields if 3)
    sysctl.rp_filter        net.ipv4.conf.{all,<fabric NIC>}.rp_filter (all/default without --config)
    sysctl.icmp_errors      net.ipv4.icmp_errors_use_inbound_ifaddr, net.ipv4.ip_forward
    sysctl.port_range       net.ipv4.ip_local_port_range, net.ipv4.ip_local_reserved_ports
    cap.*                   CapEff in /proc/self/status (this process's effective capabilities);
                            for SCHED_FIFO also RLIMIT_RTPRIO (the unit's LimitRTPRIO= instead of CAP_SYS_NICE)
    config                  the --config file (parsed like the agent does), its fleet key file
    nic.<ifname>            `ip -j link/addr show`, `ip -j neigh show`, `ip -j route get <gateway>`
    rdma                    /sys/class/infiniband/*/ports/*/state and gid_attrs/ndevs/0
    route.<peer>            `ip -j route show match <peer service address>` (longest prefix wins)
    clock                   adjtimex(2) with modes=0 (return state, STA_UNSYNC, esterror)
    agent                   GET http://127.0.0.1:<api port>/v1/state (in the namespace)

Exit code: 2 if any check fails, 1 if any warns, else 0; 3 if the namespace does not exist.
"""
