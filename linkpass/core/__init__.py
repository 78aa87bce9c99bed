"""Pure core: wire format, clock estimation, path tables, statistics. No I/O, no clock or randomness reads."""
