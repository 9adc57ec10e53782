"""The few exception types the CLI turns into one-line messages and exit code 2.

Anything the user can cause (a bad file, a bad flag value, a full disk) is raised as a
K3Error with a message that names the file and the problem. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations


class K3Error(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


class FormatError(K3Error):
    """A file is not what it claims to be (bad magic, truncated, absurd counts, ...)."""


class ShardError(K3Error):
    """A sharded model is incomplete or inconsistent (missing/duplicate shard, bad counts)."""


class ConvertError(K3Error):
    """A checkpoint cannot be converted (missing tensor, wrong shape, unknown quant format)."""


class VerifyError(K3Error):
    """A written output does not match what it was supposed to contain."""
