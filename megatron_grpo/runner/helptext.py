"""The help format of every command line of the project: each option says what it does and its default.

`DefaultsHelpFormatter` appends `(default: X)` to an option's help unless the help already names its default
(for defaults that depend on another option, such as `--quick`); a flag's default reads `off`. A required option
or a positional argument has no default to show.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with each option's default shown in the user's terms."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or "default" in text
                or action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction)):
            return text
        return f"{text} (default: {shown_default(action)})"


def shown_default(action: argparse.Action) -> str:
    """`off` for a flag, the words of a list, the value otherwise (`%` escaped for argparse's formatting)."""
    if action.nargs == 0 and action.default is False:
        return "off"
    value = action.default
    words = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return words.replace("%", "%%")
