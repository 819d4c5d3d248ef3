"""Regression repro emitted by `specgate repro --emit-pytest`.

Run it with: pytest test_vllm_state_machine.py --specgate-backend <backend> (without a backend named it fails:
a repro that ran on the reference engine by accident would pass while the bug is present).
It replays SCENARIO through specgate's adapter: 3 actions over 1 engine
instance(s), each then run to completion, checking the invariants after every step, greedy
outputs against the reference, finish reasons, and that each run ends idle. CHECK names the
check it was recorded from, RECORDED_ON the backend and FAILURE how it failed there.
"""

import pytest

from conformance.repro.replay import replay
from conformance.repro.scenario import parse

CHECK = 'test_fuzz.py::test_state_machine'
RECORDED_ON = 'vllm'
FAILURE = "conformance.repro.divergence.Diverged: first divergence: run 0, actions[3] (run to completion), step 15, request 'r1' expected: finish text ending '):\\n ' (cut before the earliest stop string) came..."
SCENARIO = (
    '{\n'
    ' "specgate_repro": 1,\n'
    ' "checks": [\n'
    '  "invariants after every step",\n'
    '  "greedy outputs against the reference as they stream",\n'
    '  "finish reasons",\n'
    '  "every run ends idle",\n'
    '  "a seeded sampled request comes out the same every time it runs"\n'
    ' ],\n'
    ' "check": "test_fuzz.py::test_state_machine",\n'
    ' "failure": "conformance.repro.divergence.Diverged: first divergence: run 0, actions[3] (run to completion), step 15, request \'r1\'\\n  expected: finish text ending \'):\\\\n      \' (cut before the earliest stop string)\\n  came:     finish text ending \'):\\\\n        \'\\n  memory before: capacity 4096, free 4064, held 0, page 32; rows 0/0 in use; requests (committed/allocated): r1: 9/32 decode\\n  memory after:  capacity 4096, free 4096, held 0, page 32; rows 0/0 in use; requests (committed/allocated): none\\nFailing test case: <state machine>\\nstate = AdapterMachine()\\nDraw 1 (page_size): 32\\nDraw 2 (tight pool): False\\nDraw 3 (chunked prefill): True\\nDraw 4 (max_prefill_tokens): 8\\nstate.open_engine(data=data(...))\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nstate.step()\\nDraw 5 (prompt kind): \'cut\'\\nDraw 6 (prompt): PromptCase(id=\'small-001\',\\n text=\'    def initialize_options(self):\\\\n        self.build_lib = None\\\\n        self.py_modules = None\\\\n        self.package = None\\\\n\',\\n ids=(259,\\n  346,\\n  309,\\n  1421,\\n  813,\\n  63,\\n  1494,\\n  8,\\n  279,\\n  306,\\n  267,\\n  291,\\n  14,\\n  1787,\\n  63,\\n  641,\\n  282,\\n  406,\\n  267,\\n  291,\\n  14,\\n  659,\\n  63,\\n  2038,\\n  282,\\n  406,\\n  267,\\n  291,\\n  14,\\n  1101,\\n  559,\\n  282,\\n  406,\\n  199))\\nDraw 7 (prompt tokens): 9\\nDraw 8 (max_new_tokens): 15\\nDraw 9 (ignore_eos): False\\nDraw 10 (sampled): 1\\nDraw 11 (stop): \'string\'\\nDraw 12 (stop at output index): 2\\nstate.submit(data=data(...))\\nstate.step()\\nstate.teardown()",\n'
    ' "backend": "vllm",\n'
    ' "runs": [\n'
    '  {\n'
    '   "config": {\n'
    '    "model": "tiny-code",\n'
    '    "spec": {\n'
    '     "algorithm": "eagle",\n'
    '     "draft_model": "tiny-code-eagle",\n'
    '     "num_steps": 3,\n'
    '     "topk": 1,\n'
    '     "num_draft_tokens": 4,\n'
    '     "overlap": false\n'
    '    },\n'
    '    "kv_pool_tokens": 4096,\n'
    '    "page_size": 32,\n'
    '    "max_running_requests": null,\n'
    '    "max_prefill_tokens": 8,\n'
    '    "seed": 0,\n'
    '    "retract_every": 0,\n'
    '    "graph_executor": null,\n'
    '    "device": "cpu"\n'
    '   },\n'
    '   "actions": [\n'
    '    {\n'
    '     "op": "step",\n'
    '     "times": 13\n'
    '    },\n'
    '    {\n'
    '     "op": "submit",\n'
    '     "rid": "r1",\n'
    '     "prompt_ids": [259, 346, 309, 1421, 813, 63, 1494, 8, 279],\n'
    '     "params": {\n'
    '      "max_new_tokens": 15,\n'
    '      "stop": [\n'
    '       "\\"\\"\\"",\n'
    '       " \\"\\"\\"",\n'
    '       "  \\"\\"\\""\n'
    '      ]\n'
    '     }\n'
    '    },\n'
    '    {\n'
    '     "op": "step",\n'
    '     "times": 2\n'
    '    }\n'
    '   ]\n'
    '  }\n'
    ' ]\n'
    '}\n'
)


def test_fuzz_test_state_machine(specgate_backend):
    divergence = replay(parse(SCENARIO, 'test_vllm_state_machine.py: SCENARIO'), specgate_backend)
    if divergence is not None:
        pytest.fail(f"on backend {specgate_backend.name!r}: " + divergence.describe(),
                    pytrace=False)
