"""Errors the user can act on. The CLI turns them into a message and an exit code; nothing else catches them."""

from __future__ import annotations

# Exit codes (public, listed in the README).
EXIT_OK = 0
EXIT_FAILED = 1  # unrecoverable failure: the message and metrics.jsonl say why
EXIT_BAD_INPUT = 2  # bad usage or bad input: the message names the file or flag
EXIT_PREEMPTED = 3  # stopped on request (SIGTERM/SIGUSR1/save-and-exit) after a clean checkpoint


class BadInput(Exception):
    """Bad usage or bad input. The message must name the file or flag and say what is wrong."""

    exit_code = EXIT_BAD_INPUT


class Preempted(Exception):
    """The run stopped on request after writing a complete checkpoint; rerunning resumes it."""

    exit_code = EXIT_PREEMPTED
