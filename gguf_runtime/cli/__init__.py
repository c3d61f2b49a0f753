"""The command line: parses and prints; everything else lives in the core package."""
