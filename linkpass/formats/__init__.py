"""File and output formats with a third-party parser behind them, each imported in one place."""
