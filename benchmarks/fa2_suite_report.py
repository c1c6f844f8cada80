"""Counts of a FlashAttention-2 suite run (``tests/fa2_suite``) per test function, from
pytest's JUnit XML: passed, failed (wrong results and errors), xfailed and skipped, with the
reasons of the last two and the selection the conftest recorded (the table's deselected
cases, the sample's size). Several files (the shards of one sample) add up.

    FLASHTUNE_TEST_DEVICE=cuda python -m pytest tests/fa2_suite -p no:cacheprovider -q \\
        --junitxml=fa2.xml
    python benchmarks/fa2_suite_report.py fa2.xml [more shards...] [--rerun rerun.xml]
        [--json out.json]

Exit status 1 when a case failed (a wrong result, an error, or a strict xfail that passed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUTCOMES = ("passed", "failed", "xfailed", "skipped")


def outcome(case: ET.Element) -> tuple[str, str]:
    """``(outcome, reason)`` of one ``<testcase>``."""
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            return "failed", (node.get("message") or tag).splitlines()[0][:160]
    node = case.find("skipped")
    if node is not None:
        kind = "xfailed" if node.get("type") == "pytest.xfail" else "skipped"
        reason = node.get("message") or ""
        return kind, re.sub(r"^(expected fail: |Skipped: )", "", reason)
    return "passed", ""


def suite_cases(root: ET.Element) -> Iterator[tuple[str, ET.Element]]:
    """``(case id, <testcase>)`` of the suite's cases in one JUnit XML (not the harness's
    CPU tests)."""
    for case in root.iter("testcase"):
        if case.get("classname", "").endswith("fa2_suite.test_flash_attn"):
            yield case.get("name", ""), case


def read(paths: list[Path], reruns: list[Path] = ()) -> dict[str, Any]:
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    reasons: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    seconds: Counter[str] = Counter()
    selection: dict[str, list[int]] = {}
    table: Counter[str] = Counter()
    properties: dict[str, str] = {}
    cases: dict[str, ET.Element] = {}
    for path in paths:
        root = ET.parse(path).getroot()
        for prop in root.iter("property"):
            name, value = prop.get("name", ""), prop.get("value", "")
            if name.startswith("fa2_function "):
                total, eligible, run = (int(x) for x in value.split())
                seen = selection.setdefault(name.split(" ", 1)[1], [total, eligible, 0])
                seen[2] += run
            elif name.startswith(("fa2_deselect ", "fa2_skip ", "fa2_xfail ")):
                action, reason = name[4:].split(" ", 1)
                # deselect rows count all cases (the same in every shard); the others the run's
                if action == "deselect":
                    table[f"{action}: {reason}"] = int(value)
                else:
                    table[f"{action}: {reason}"] += int(value)
            elif name.startswith("fa2_"):
                properties[name[4:]] = value
        cases.update(suite_cases(root))
    replaced = []
    for path in reruns:
        for ident, case in suite_cases(ET.parse(path).getroot()):
            if ident not in cases:
                raise SystemExit(f"--rerun {path}: {ident} is in none of the runs' files")
            first, reason = outcome(cases[ident])
            replaced.append({"case": ident, "first": first, "first_reason": reason,
                             "rerun": outcome(case)[0]})
            cases[ident] = case
    for ident, case in cases.items():
        test = ident.split("[")[0]
        kind, reason = outcome(case)
        counts[test][kind] += 1
        seconds[test] += float(case.get("time") or 0)
        if kind != "passed":
            reasons[(test, kind)][reason] += 1
    return {"counts": counts, "reasons": reasons, "seconds": seconds,
            "selection": selection, "table": table, "properties": properties,
            "reruns": replaced}


def render(report: dict[str, Any]) -> str:
    counts, selection = report["counts"], report["selection"]
    lines = []
    props = report["properties"]
    if props:
        lines.append(f"FlashAttention-2 {props.get('commit', '?')[:12]}, "
                     f"{props.get('cases_per_function', '?')} cases per function, "
                     f"seed {props.get('seed', '?')}")
    head = f"{'test function':48} " + " ".join(f"{o:>8}" for o in OUTCOMES) + \
        f" {'run':>5} {'cases':>7} {'seconds':>8}"
    lines += [head, "-" * len(head)]
    total: Counter[str] = Counter()
    for test in sorted(set(counts) | set(selection)):
        c = counts.get(test, Counter())
        total.update(c)
        cases = selection.get(test, [0, 0, 0])[0]
        lines.append(f"{test:48} " + " ".join(f"{c[o]:8}" for o in OUTCOMES)
                     + f" {sum(c.values()):5} {cases:7} {report['seconds'][test]:8.1f}")
    lines.append(f"{'total':48} " + " ".join(f"{total[o]:8}" for o in OUTCOMES)
                 + f" {sum(total.values()):5} "
                 f"{sum(s[0] for s in selection.values()):7} "
                 f"{sum(report['seconds'].values()):8.1f}")
    if report["reasons"]:
        lines += ["", "not passed, by reason:"]
        for (test, kind), reasons in sorted(report["reasons"].items()):
            for reason, n in reasons.most_common():
                lines.append(f"  {test} {kind} x{n}: {reason}")
    if report["reruns"]:
        lines += ["", "run again on their own (the first run's outcome replaced):"]
        lines += [f"  {r['case']}: {r['first']} ({r['first_reason'][:80]}) -> {r['rerun']}"
                  for r in report["reruns"]]
    if report["table"]:
        lines += ["", "the conftest's table (deselect: of all cases; skip/xfail: of the run):"]
        for row, n in sorted(report["table"].items()):
            lines.append(f"  {n:7}  {row}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("xml", nargs="+", type=Path, help="pytest --junitxml file(s)")
    parser.add_argument("--rerun", nargs="*", type=Path, default=[],
                        help="JUnit XML of cases run again on their own: their outcome "
                             "replaces the same case's in the runs' files")
    parser.add_argument("--json", type=Path, help="also write the counts here")
    args = parser.parse_args(argv)
    report = read(args.xml, args.rerun)
    print(render(report))
    if args.json:
        out = {
            "properties": report["properties"],
            "functions": {t: dict(c) for t, c in sorted(report["counts"].items())},
            "selection": {t: dict(zip(("cases", "eligible", "run"), s))
                          for t, s in sorted(report["selection"].items())},
            "reasons": [{"test": t, "outcome": k, "reason": r, "count": n}
                        for (t, k), rs in sorted(report["reasons"].items())
                        for r, n in rs.most_common()],
            "table": dict(report["table"]),
            "reruns": report["reruns"],
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 1 if any(c["failed"] for c in report["counts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
