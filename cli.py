"""Thin shim: `python cli.py fit ...` behaves like `diffexp fit ...`."""

from diffexp.cli import main

if __name__ == "__main__":
    main()
