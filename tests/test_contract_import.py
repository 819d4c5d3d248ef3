"""The contract stands alone: ``conformance.contract`` imports neither torch nor the reference
engine (nor numpy), and a backend built from it alone is driven through the protocol."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TOY = '''
import sys
for blocked in ("torch", "refengine", "numpy"):
    sys.modules[blocked] = None  # any import of them now raises ImportError

from conformance.contract import (Backend, Capabilities, EngineHandle, FinishEvent, MemoryView,
                                  OpenConfig, Request, SamplingParams, TokenEvent,
                                  unclaimed_reasons)


class EchoHandle:
    """Emits each request's prompt back, one token per step, then finishes by length."""

    def __init__(self):
        self.live = {}

    def submit(self, req):
        self.live[req.rid] = [list(req.prompt_ids), [], req.params]

    def step(self):
        events = []
        for rid, (prompt, out, params) in list(self.live.items()):
            out.append(prompt[len(out) % len(prompt)])
            events.append(TokenEvent(rid, (out[-1],)))
            if len(out) == params.max_new_tokens:
                events.append(FinishEvent(rid, "length", tuple(out)))
                del self.live[rid]
        return events

    def abort(self, rid):
        self.live.pop(rid, None)

    def memory(self):
        return MemoryView(capacity=0, free=0, held=0, page_size=1)

    def open_session(self, session_id):
        pass

    def close_session(self, session_id):
        pass

    def close(self):
        self.live.clear()


class EchoBackend:
    name = "echo"
    version = "1"

    def capabilities(self):
        return Capabilities(stepwise=True, abort=True)

    def unclaimed_reasons(self):
        return {"sampling": "it only echoes"}

    def open(self, cfg):
        return EchoHandle()


backend = EchoBackend()
assert isinstance(backend, Backend)
assert unclaimed_reasons(backend) == {"sampling": "it only echoes"}
handle = backend.open(OpenConfig())
assert isinstance(handle, EngineHandle)
handle.submit(Request("a", (5, 6, 7), SamplingParams(max_new_tokens=4)))
finished = []
while handle.live:
    finished += [ev for ev in handle.step() if isinstance(ev, FinishEvent)]
assert finished == [FinishEvent("a", "length", (5, 6, 7, 5))], finished
handle.close()
assert not any(name.split(".")[0] in ("torch", "refengine", "numpy")
               for name, mod in sys.modules.items() if mod is not None)
print("ok")
'''


def test_the_contract_builds_and_drives_a_backend_without_torch_or_the_engine() -> None:
    done = subprocess.run([sys.executable, "-c", TOY], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_old_adapter_module_re_exports_the_contract() -> None:
    import conformance.adapter as adapter
    import conformance.contract as contract

    assert adapter.__all__ == contract.__all__
    for name in contract.__all__:
        assert getattr(adapter, name) is getattr(contract, name), name
