"""CI's summary of a pytest run from its JUnit XML: counts, and every skip grouped by reason.

    python .ci/summary.py RESULTS.xml [--fail-on-skip PATTERN]

Prints `CI summary: N tests: P passed, F failed, E errors, S skipped` and one line per skip reason
with its count and tests. `--fail-on-skip PATTERN` exits 1 when a test whose id contains PATTERN was
skipped (a skipped integration test is not a pass: .ci/run uses it for tests/test_megatron_lm_)."""
import argparse
import collections
import sys
import xml.etree.ElementTree as ET


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("junit")
    p.add_argument("--label", default="")
    p.add_argument("--fail-on-skip", action="append", default=[])
    a = p.parse_args(argv)
    counts = collections.Counter()
    skips = collections.defaultdict(list)
    for case in ET.parse(a.junit).getroot().iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        if not kinds:
            counts["passed"] += 1
        for c in case:
            if c.tag == "skipped":
                counts["skipped"] += 1
                skips[(c.get("message") or "").strip()].append(tid)
            elif c.tag in ("failure", "error"):
                counts["failed" if c.tag == "failure" else "errors"] += 1
    total = sum(counts.values())
    print(f"CI summary{' (' + a.label + ')' if a.label else ''}: {total} tests: {counts['passed']} passed, "
          f"{counts['failed']} failed, {counts['errors']} errors, {counts['skipped']} skipped")
    for reason, tests in sorted(skips.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(t.rsplit(".", 1)[-1] for t in tests[:3]) + (" ..." if len(tests) > 3 else "")
        print(f"  skipped {len(tests)} x {reason}  [{shown}]")
    bad = [t for tests in skips.values() for t in tests for pat in a.fail_on_skip if pat in t]
    if bad:
        print(f"CI FAILURE: {len(bad)} test(s) that CI must run were skipped: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
