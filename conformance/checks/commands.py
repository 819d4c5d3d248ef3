"""``specgate golden`` and ``specgate expected``: record or check the golden acceptance traces
and the committed expected outputs."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from conformance.plan.arguments import count
from conformance.plan.preflight import validate
from conformance.plan.usage import UsageError
from conformance.report.files import write_atomically

if TYPE_CHECKING:
    from conformance.contract import SpecConfig


def add_golden_arguments(parser: argparse.ArgumentParser) -> None:
    from conformance.checks.golden_scenarios import SCENARIOS
    from conformance.plan.specs import SPECS

    parser.add_argument("action", choices=["record", "check"])
    parser.add_argument("--spec", default="all",
                        help=f"{' | '.join(n for n in SPECS if n != 'none')} | all")
    parser.add_argument("--prompt-set", default="default", help="a set in fixtures/prompts")
    parser.add_argument("--max-new-tokens", type=count, default=128,
                        help="tokens per request of the plain trace (the chunked and session "
                             "traces: 32)")
    parser.add_argument("--trace", action="append", choices=list(SCENARIOS), default=None,
                        help="only this trace of each configuration (repeatable; default: all)")
    parser.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    parser.add_argument("--draft-model", default=None,
                        help="a bundled draft fixture in place of the spec's own (one --spec): "
                             "its traces are kept under golden/<config>@<draft model>")


def add_expected_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["record", "check"])
    parser.add_argument("--model", default="tiny-code", help="a bundled fixture")


def _golden_configs(spec: str, draft_model: str | None = None) -> list[SpecConfig]:
    """The spec's configurations with traces of their own; with ``draft_model``, drafting
    with that bundled model instead (its traces sit under ``<config>@<draft model>``)."""
    from conformance.checks.golden import golden_path
    from conformance.plan.specs import resolve_specs

    try:
        choices = resolve_specs(spec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if draft_model is not None:
        if len(choices) != 1 or not any(c is not None and c.needs_draft_model
                                        for c in choices[0].configs):
            raise UsageError(f"--draft-model: needs one --spec whose configurations have a "
                             f"draft model, got --spec {spec}")
        choices = [choices[0].with_draft_model(draft_model)]
    # Overlap configurations are held to their sequential twins' traces (golden_path).
    configs = [c for choice in choices for c in choice.configs
               if c is not None and not c.overlap]
    if not configs:
        raise UsageError(f"--spec {spec}: has no acceptance traces of its own (plain decoding "
                         "has none; overlap configurations use their sequential twins')")
    try:
        for config in configs:
            golden_path(config, "default")  # a draft model traces can be named by
    except ValueError as err:
        raise UsageError(f"--draft-model: {err}") from None
    return configs


def cmd_golden(args: argparse.Namespace) -> int:
    from conformance.checks import golden
    from conformance.checks.golden_scenarios import SCENARIOS
    from conformance.plan.prompts import load_prompt_set
    from conformance.report.progress import Steps

    validate("none", [], args.model, args.draft_model)
    configs = _golden_configs(args.spec, args.draft_model)
    try:
        load_prompt_set(args.prompt_set, args.model)
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    failed = 0
    scenarios = [SCENARIOS[name] for name in args.trace or SCENARIOS]
    runs = [(config, scenario) for config in configs for scenario in scenarios]
    with Steps(f"golden {args.action}", len(runs)) as steps:
        for config, scenario in runs:
            name = scenario.trace_name(args.prompt_set)
            label = golden.trace_dir_name(config)
            steps.start(f"{label} on {name}")
            trace = golden.record(config, args.prompt_set, args.model, args.max_new_tokens,
                                  scenario)
            path = golden.golden_path(config, name)
            s = trace.summary
            line = (f"{label} {name}: mean tau {s['mean_tau']}, per-position "
                    f"acceptance {s['per_position_acceptance']}, {s['verify_steps']} verify "
                    "steps")
            if args.action == "record":
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(trace.to_json())
                print(f"{line} -> {path}", flush=True)
                steps.done(f"written, mean tau {s['mean_tau']}")
                continue
            if not path.exists():
                print(f"{label} {name}: MISSING {path}", flush=True)
                steps.done("MISSING")
                failed += 1
                continue
            stored = golden.GoldenTrace.from_json(path.read_text())
            diffs = [r.id for r, g in zip(trace.requests, stored.requests, strict=False)
                     if r != g]
            same = trace.to_json() == stored.to_json()
            print(f"{line}: {'matches' if same else 'DIFFERS'} {path}"
                  + (f" (requests {diffs[:5]})" if diffs else ""), flush=True)
            steps.done("matches" if same else "DIFFERS")
            failed += 0 if same else 1
    return 1 if failed else 0


def cmd_expected(args: argparse.Namespace) -> int:
    from conformance.checks import expected, expected_record
    from refengine.data import fixture_names

    validate("none", [], args.model)
    if args.model not in fixture_names():
        raise UsageError(f"--model {args.model}: expected outputs are recorded for bundled "
                         f"fixtures only ({', '.join(fixture_names())})")
    try:
        import transformers  # noqa: F401  (the recording is checked against it)
    except ImportError:
        raise UsageError("expected: recording is checked against transformers; install it "
                         "with: pip install 'specgate[hf]'") from None
    path = expected.expected_path(args.model)
    try:
        recorded = expected_record.record(args.model)
    except expected_record.ExpectedMismatch as err:
        print(f"specgate expected: transformers disagrees, nothing written: {err}", flush=True)
        return 1
    ties = sum(len(c.hf_near_ties) for c in recorded.continuations.values())
    line = (f"{args.model}: {len(recorded.continuations)} prompts, "
            f"{sum(len(c.tokens) for c in recorded.continuations.values())} tokens, "
            f"agree with transformers (near-ties: {ties})")
    if args.action == "record":
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, recorded.to_json())
        print(f"{line} -> {path}", flush=True)
        return 0
    if not path.exists():
        print(f"{line}: MISSING {path}", flush=True)
        return 1
    changed = expected.differences(expected.ExpectedOutputs.from_json(path.read_text()),
                                   recorded)
    verdict = ("matches" if not changed else f"DIFFERS ({len(changed)}: {'; '.join(changed[:3])})"
               f" from")
    print(f"{line}: {verdict} {path} (margins within {expected.MARGIN_TOLERANCE:g})",
          flush=True)
    return 0 if not changed else 1
