"""Quoting for the one place a value meets a shell: the command DeepSpeed's runner hands to pdsh.

DeepSpeed 0.19.8's pdsh path builds a remote shell command by plain string joining: the script and
space-free arguments go in as they are, arguments with a space are wrapped in double quotes (only
`"` escaped), and each `.deepspeed_env` value with a character outside `[\\w@%+=:,./-]` is wrapped
in double quotes with nothing escaped. The helpers here pre-escape values so that, after DeepSpeed's
own wrapping, the remote shell sees exactly the original text.
"""

import re
import shlex

from neox.launcher.hostfile import LaunchError

# Characters DeepSpeed's MultiNodeRunner.add_export leaves unquoted.
_EXPORT_SAFE = re.compile(r"^[\w@%+=:,./-]*$")
# Inside double quotes these four keep a meaning for the shell; a backslash makes them literal.
_DOUBLE_QUOTE_SPECIAL = re.compile(r'([\\$`"])')
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def quote_pdsh_script(path: str) -> str:
    """Quote the entry script path, which DeepSpeed puts into the remote command untouched."""
    return shlex.quote(path)


def quote_pdsh_arg(arg: str) -> str:
    """Quote one script argument so it survives DeepSpeed's pdsh handling and the remote shell."""
    if " " in arg:
        # DeepSpeed will wrap it as "..." and escape `"`; escape the rest of the specials here.
        return re.sub(r"([\\$`])", r"\\\1", arg)
    return shlex.quote(arg)  # no space in, none out: DeepSpeed passes it through as is


def encode_export(name: str, value: str) -> str:
    """One `.deepspeed_env` line that makes `name` equal `value` on every node."""
    if not _NAME.match(name):
        raise LaunchError(
            f"environment variable name {name!r} cannot be exported to the nodes; "
            "names are letters, digits and '_', not starting with a digit"
        )
    if "\n" in value or "\r" in value:
        raise LaunchError(
            f"environment variable {name} holds a line break, which .deepspeed_env cannot carry; "
            "remove it from launcher.export_env or change its value"
        )
    if value != value.strip():
        raise LaunchError(
            f"environment variable {name}={value!r} starts or ends with whitespace, which "
            "DeepSpeed strips on export; trim the value"
        )
    if _EXPORT_SAFE.match(value):
        return f"{name}={value}"
    # DeepSpeed wraps it in double quotes; make everything special inside them literal.
    escaped = _DOUBLE_QUOTE_SPECIAL.sub(r"\\\1", value)
    return f"{name}={escaped}"


def is_shell_plain(text: str) -> bool:
    """True when `text` means the same to a shell with or without quoting."""
    return bool(_EXPORT_SAFE.match(text))
