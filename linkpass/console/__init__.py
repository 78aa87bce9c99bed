"""What a command shows and takes at the terminal, shared by every package with commands (the CLI,
the demo, the testbed): output formats (table, wide, json, yaml), colours, the shared exit codes
(`output.py`), and path arguments made absolute (`files.py`)."""
