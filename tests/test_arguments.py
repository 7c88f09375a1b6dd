"""``train_grpo.py``'s command line: every flag documented with its default, and ``--help``
answered without torch, Megatron or transformers."""

import argparse
import subprocess
import sys
from pathlib import Path

from megatron_longstraw.training.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)


def test_every_flag_has_help_and_shows_its_default():
    parser = build_parser()
    formatter = parser._get_formatter()
    flags = [a for a in parser._actions if a.option_strings]
    assert len(flags) > 60
    for action in flags:
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings
        if not isinstance(action, SWITCHES):  # a switch is off unless given
            assert "default" in formatter._get_help_string(action), action.option_strings
        assert None not in (action.choices or ()), action.option_strings
    text = parser.format_help()
    assert "None" not in text and "(default: 4)" in text  # --train-iters


def test_help_imports_no_torch_megatron_or_transformers():
    heavy = ("torch", "megatron", "transformers")
    code = ("import runpy, sys\n"
            "import megatron_longstraw.training.arguments as arguments\n"
            "arguments.build_parser()\n"
            "sys.argv = ['train_grpo.py', '--help']\n"
            "try:\n"
            f"    runpy.run_path({str(ROOT / 'train_grpo.py')!r}, run_name='__main__')\n"
            "except SystemExit as stop:\n"
            "    assert stop.code in (0, None), stop.code\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--train-iters" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:]
