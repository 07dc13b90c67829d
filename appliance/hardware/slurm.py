"""What a SLURM batch script asks the scheduler for, written once for both script writers (`sbatch`:
train/slurm.py; `prep --sbatch`: data/prep_slurm.py): the shebang, one `#SBATCH` line per directive with the
optional partition and account last, and the checks of every value that lands in a script.

Two readers parse a script. bash runs its body: there every word from the user, the plan or the file system is
`shlex.quote`d by the writer. sbatch reads its `#SBATCH` lines first, with rules of its own (src/sbatch/opt.c,
`_get_argument`): a line ends an option list, whitespace splits words, a quote (' or ") or a backslash escapes, an
unescaped `#` starts a comment, and a line holding "hetjob" or "packjob" anywhere is cut there into a heterogeneous
job's components. So a value that could hold any of these is either refused (names: SLURM's own character set) or
escaped for sbatch (`sbatch_word`), and nothing anywhere may hold a control character: a newline in a value would
end the `#SBATCH` line and start a command of the script.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from appliance.errors import BadInput

# Partition, account and job names: SLURM's own names are letters, digits, '.', '_' and '-'; Jean Zay's accounts
# add '@' (abc@a100) and a partition list is comma-separated. Nothing here is special to sbatch's reader or bash.
SLURM_NAME_CHARS = re.compile(r"[A-Za-z0-9._@,-]+")
# sbatch's reader takes these as word breaks, quotes, escapes or a comment's start; escaped with a backslash.
_SBATCH_SPECIAL = re.compile(r"""([\s"'#\\])""")
# The separators of a heterogeneous job's components, matched case-insensitively in the raw line: an escape inside
# the word ("het\job") hides it from that match and sbatch's reader then drops the backslash.
_SBATCH_COMPONENT_WORD = re.compile(r"(het|pack)(job)", re.IGNORECASE)


def check_time_limit(time_limit: str, flag: str) -> None:
    """SLURM's [D-]HH:MM:SS (or MM, MM:SS, D-HH...): up to four numeric parts; `flag` names the setting."""
    parts = time_limit.replace("-", ":").split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 4:
        raise BadInput(f"{flag} {time_limit!r}: expected [D-]HH:MM:SS")


def check_script_text(value: str | Path, flag: str) -> None:
    """A value that lands in a generated script holds no control character (a newline would end its line and start
    a command) and nothing a UTF-8 script cannot hold (a file name's undecodable bytes)."""
    for char in str(value):
        kind = {"Cc": "a control character", "Cs": "an undecodable byte"}.get(unicodedata.category(char))
        if kind:
            raise BadInput(f"{flag} {str(value)!r}: holds {kind} (U+{ord(char):04X}), which a script cannot carry")


def check_slurm_name(name: str, flag: str) -> None:
    """A partition, account or job name: SLURM_NAME_CHARS only, so that it is one intact word for sbatch."""
    check_script_text(name, flag)
    if not SLURM_NAME_CHARS.fullmatch(name):
        bad = sorted({c for c in name if not SLURM_NAME_CHARS.fullmatch(c)})
        raise BadInput(f"{flag} {name!r}: {' '.join(map(repr, bad))} not allowed (letters, digits and . _ - @ , only)")


def check_partition_and_account(partition: str | None, account: str | None) -> None:
    """--partition and --account, where given: SLURM names (check_slurm_name)."""
    for name, flag in ((partition, "--partition"), (account, "--account")):
        if name is not None:
            check_slurm_name(name, flag)


def job_name_for(model_name: str) -> str:
    """The job name for a model: its name, with every character outside SLURM_NAME_CHARS replaced by '_' (a job
    name is a label in squeue; an imported model is named after its directory, spaces and all). A control
    character is refused: no model name holds one unless its plan.json or TOML was tampered with."""
    check_script_text(model_name, "the model name (plan.json's model.name, or --model's)")
    return "".join(c if SLURM_NAME_CHARS.fullmatch(c) else "_" for c in model_name) or "bloom"


def check_output_dir(path: Path, flag: str) -> None:
    """A directory whose path goes into an `--output=` file name. slurmd reads a backslash there as "expand no %
    pattern" and drops it, so the log would land elsewhere; a '%' is escaped instead (slurm_file_name)."""
    check_script_text(path, flag)
    if "\\" in str(path):
        raise BadInput(f"{flag} {str(path)!r}: a backslash in the path is not allowed (SLURM's log file name)")


def slurm_file_name(path: Path) -> str:
    """`path` as the literal start of an --output pattern: '%' doubled, so that only the caller's %j, %x ... expand."""
    return str(path).replace("%", "%%")


def sbatch_word(directive: str) -> str:
    """A directive written so that sbatch's reader gives back exactly `directive`, as one word."""
    escaped = _SBATCH_SPECIAL.sub(r"\\\1", directive)
    return _SBATCH_COMPONENT_WORD.sub(r"\1\\\2", escaped)


def sbatch_header(directives: list[str], *, partition: str | None, account: str | None) -> list[str]:
    """The script's first lines, ending with a blank one. Every directive is one word for sbatch (sbatch_word)."""
    check_partition_and_account(partition, account)
    chosen = [f"--partition={partition}"] * bool(partition) + [f"--account={account}"] * bool(account)
    for directive in directives:
        check_script_text(directive, "#SBATCH")
    return ["#!/bin/bash", *(f"#SBATCH {sbatch_word(d)}" for d in [*directives, *chosen]), ""]
