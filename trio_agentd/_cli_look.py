"""``ps``/``status`` and ``doctor``: every supervisor found, what is wrong with each, and
``doctor --fix``. A warm path: parsed without argparse (:func:`._cli_args.look_args`)."""

from __future__ import annotations

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._cli_exit import EXIT_DOCTOR, EXIT_OK

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    import argparse

    from ._paths import Layout


def cmd_ps(layout: Layout, args: argparse.Namespace) -> int:
    from ._doctor import survey
    from ._report import print_table
    from ._trust import home_problem

    if (problem := home_problem(layout)) is not None:
        raise problem  # it could not look: not "no supervisor found" and exit 0

    found = survey(layout)
    if args.json:
        print(json.dumps([f.as_json() for f in found]))
    else:
        print_table(found)
    return EXIT_OK


def cmd_doctor(layout: Layout, args: argparse.Namespace) -> int:
    from ._report import run_doctor
    from ._trust import home_problem

    if (problem := home_problem(layout)) is not None:
        raise problem  # it could not look: not "nothing found" and exit 0
    unfixed = run_doctor(layout, fix=args.fix and not args.dry_run, dry_run=args.dry_run,
                         as_json=args.json)
    return EXIT_DOCTOR if unfixed else EXIT_OK
