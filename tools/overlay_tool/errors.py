"""Errors with documented exit codes."""
from __future__ import annotations

# Exit codes (also in `tools/apply.py --help` and README.md).
OK = 0
INTERNAL = 1  # a bug in the tool: one line (traceback with --debug)
USAGE = 2  # bad command line (argparse) or bad project input (series, verify.toml, CONCERNS.toml)
PIN = 3  # unknown --vllm, malformed pins.lock, tree/checkout holds another version
FETCH = 4  # download failed, sha256 mismatch
REFUSED = 5  # dirty tree, branch exists, tree locked by another command, recovery refused, ...: nothing touched
PATCH = 6  # a patch or the overlay does not apply: tree rolled back; port: stopped at a conflict (tree left mid-merge)
CHECK = 7  # check/refresh: export differs from committed patches, bad patch header
VERIFY = 8  # verification failed (tree, imports/registrations, kernel tests)
EXTERNAL = 9  # pip / venv / wheel / build command failed
CHECKOUT = 10  # after a switch the working tree is not the target commit (files named)
FILESYSTEM = 11  # permission denied, disk full, read-only file system (path named)
INTERRUPTED = 130  # Ctrl-C / SIGTERM: tree rolled back

EXIT_CODES_HELP = """exit codes:
  0    success
  1    internal error (a bug in the tool; --debug prints the traceback)
  2    usage error: bad arguments, or malformed series / verify.toml / CONCERNS.toml
  3    pin error: unknown --vllm, malformed pins.lock, tree or checkout holds another version
  4    fetch error: download failed or sha256 mismatch (cached file left untouched)
  5    refused, nothing changed: dirty tree, existing branch, another command holds the tree's lock
       (--wait waits), an interrupted run's recovery would discard changes made since, unreadable
       journal, patches/ and the tree both edited, refresh would drop patches, would replace a
       user's torch/vLLM, a port in progress, or port into a tree with commits/edits or onto a series
  6    patch error: a patch or overlay file does not apply; tree rolled back, patch/file/hunk named
       (port: stopped at a conflict, the tree left mid-merge for you: port --continue / --skip / --abort)
  7    check failed: re-export differs from patches/<version>/, or a patch header is invalid
  8    verification failed (report written)
  9    an external step failed (pip, venv, wheel pack, build, git)
  10   checkout incomplete: after switching, the working tree is not the target commit (files named)
  11   file system error: permission denied, disk full, read-only (path named)
  130  interrupted (Ctrl-C, SIGTERM, SIGHUP); tree rolled back
status exits 0 whenever it could read the state (drift, interruptions and patches that no longer
apply are reported, not failures), 2/3 for usage/pin errors."""


class ToolError(Exception):
    """An error the user can act on: message printed, exit with `code`."""

    def __init__(self, message: str, code: int = INTERNAL):
        super().__init__(message)
        self.code = code


class UsageError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, USAGE)


class PinError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, PIN)


class FetchError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, FETCH)


class RefusedError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, REFUSED)


class PatchError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, PATCH)


class CheckError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, CHECK)


class VerifyError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, VERIFY)


class ExternalError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, EXTERNAL)


class CheckoutError(ToolError):
    def __init__(self, message: str):
        super().__init__(message, CHECKOUT)
