"""Errors with documented exit codes."""
from __future__ import annotations

# Exit codes (also in `tools/apply.py --help` and README.md).
OK = 0
INTERNAL = 1  # a bug in the tool: traceback printed
USAGE = 2  # bad command line (argparse) or bad project input (series, verify.toml, CONCERNS.toml)
PIN = 3  # unknown --vllm, malformed pins.lock, tree/checkout holds another version
FETCH = 4  # download failed, sha256 mismatch
REFUSED = 5  # dirty tree, branch exists, would replace a user's torch/vLLM: nothing touched
PATCH = 6  # a patch or the overlay does not apply: tree rolled back
CHECK = 7  # check/refresh: export differs from committed patches, bad patch header
VERIFY = 8  # verification failed (tree, imports/registrations, kernel tests)
EXTERNAL = 9  # pip / venv / wheel / build command failed
INTERRUPTED = 130  # Ctrl-C / SIGTERM: tree rolled back

EXIT_CODES_HELP = """exit codes:
  0    success
  1    internal error (a bug in the tool; traceback printed)
  2    usage error: bad arguments, or malformed series / verify.toml / CONCERNS.toml
  3    pin error: unknown --vllm, malformed pins.lock, tree or checkout holds another version
  4    fetch error: download failed or sha256 mismatch (cached file left untouched)
  5    refused: dirty tree, existing branch, or would replace a user's torch/vLLM; nothing changed
  6    patch error: a patch or overlay file does not apply; tree rolled back, patch/file/hunk named
  7    check failed: re-export differs from patches/<version>/, or a patch header is invalid
  8    verification failed (report written)
  9    an external step failed (pip, venv, wheel pack, build)
  130  interrupted; tree rolled back"""


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
