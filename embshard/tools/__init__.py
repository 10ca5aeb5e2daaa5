"""Command-line entry points (`embshard plan`, `calibrate`, `checkpoint`; `embshard/cli.py` dispatches). They may
import everything; nothing imports them."""
