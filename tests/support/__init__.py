"""What more than one test module needs, by subject: test modules import from here, never from
each other (tests/unit/test_layout.py checks)."""
