"""What the end of a test session prints besides pass and fail: each notebook's time, and the modules
over 300 code lines (`conftest.pytest_terminal_summary` prints them).

A module of its own, not conftest.py, so that a test can import it by name: in a whole-suite run
`import conftest` would find whichever conftest.py was imported last (tests/cluster/ has one too).
"""


def notebook_times(stats: dict) -> list[str]:
    """One line per notebook test that recorded its time (tests/course/test_notebooks.py), by name, then the total.

    A notebook over its budget is marked, not failed: the budget is a benchmark's, and a loaded
    machine is slower without anything being wrong."""
    rows = []
    for report in (r for reports in stats.values() for r in reports):
        props = dict(getattr(report, "user_properties", ()))
        if "notebook_seconds" in props and getattr(report, "when", "call") == "call":
            name = report.nodeid.rsplit("[", 1)[-1].rstrip("]")
            seconds, budget = props["notebook_seconds"], props["notebook_budget_s"]
            note = "  (failed)" if report.outcome == "failed" else ""
            if seconds > budget:
                note += f"  over the {budget} s budget (a benchmark: reported, not a failure)"
            rows.append((name, seconds, note))
    if not rows:
        return []
    rows.sort()
    width = max(len(name) for name, _, _ in rows)
    return ([f"{name:<{width}} {seconds:6.1f} s{note}" for name, seconds, note in rows]
            + [f"{len(rows)} notebook{'s' * (len(rows) > 1)}, {sum(s for _, s, _ in rows):.1f} s in all"])


def long_modules(stats: dict) -> list[str]:
    """One line per module over 300 code lines, as tests/test_layout.py recorded them (listed, not failed)."""
    for report in (r for reports in stats.values() for r in reports):
        modules = dict(getattr(report, "user_properties", ())).get("long_modules")
        if modules is not None and getattr(report, "when", "call") == "call":
            return [f"{name} {n}" for name, n in sorted(modules.items())] or ["none"]
    return []
