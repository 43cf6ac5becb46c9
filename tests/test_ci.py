"""What .ci/run does when a stage fails, is skipped or passes: run on stand-ins.

.ci/run itself (a copy in a scratch directory) with every stage script replaced by a stand-in
that exits as told, and python3 / python by a fake that makes a "virtual environment" and
answers pip and pytest as told. Checked: the exit status, the verdict line, the order of the
reports, and that no process a stage started in the background outlives the run (each
stand-in leaves a marked `sleep` behind). The real stages run in CI itself; a CI that passes
when a stage failed would be wrong quietly, hence these cases.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.outside_cpp

# Stand-in stage scripts: each leaves a background shell behind, the run's marker its $0 (sleep
# itself takes no extra argument; `; :` keeps bash from exec'ing it).
_STAGES = {
    "xla_env.sh": '[ "${XLAENV_RC:-0}" = 0 ] || { echo "no xla env" >&2; exit 1; }\ncommand -v python\n',
    "aarch64_env.sh": '[ "${A64ENV_RC:-0}" = 0 ] || { echo "no a64 env" >&2; exit 1; }\necho "$PWD/a64env"\n',
    "aarch64.sh": 'bash -c "sleep 60; :" "$MARK" & echo "a64 build"; exit "${A64_RC:-0}"\n',
    "aarch64_qemu.sh": ('sleep "${EMU_S:-0}"; touch "$MARK.emulated"; bash -c "sleep 60; :" "$MARK" & echo "emulated"\n'
                        'exit "${EMU_RC:-0}"\n'),
    "sanitizers.sh": ('if [ "$1" = build ]; then bash -c "sleep 60; :" "$MARK" & echo "sanitizer build: 0 s"; exit "${SANB_RC:-0}"; fi\n'
                      'echo "444 passed"; exit "${SANT_RC:-0}"\n'),
}
_PYTHON3 = """#!/bin/bash
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin"; printf 'export PATH="%s/bin:$PATH"\\n' "$PWD/$3" > "$3/bin/activate"
    cp "$(dirname "$0")/python" "$3/bin/python"
fi
"""
_PYTHON = """#!/bin/bash
case "$*" in
    "-m pytest") echo "suite ran"; exit "${SUITE_RC:-0}" ;;
    *test_tpu_xla*) echo "xla tests"; exit "${XLA_RC:-0}" ;;
    *) exit 0 ;;
esac
"""


@pytest.fixture(scope="module")
def ci(tmp_path_factory):
    """Runs the stand-in CI with the given environment: (exit status, output, whether the
    emulation stand-in got to its end)."""
    root = tmp_path_factory.mktemp("ci")
    (root / ".ci").mkdir()
    shutil.copy(os.path.join(REPO, ".ci", "run"), root / ".ci" / "run")
    for name, body in _STAGES.items():
        (root / ".ci" / name).write_text(body)
    (root / "requirements-test.txt").write_text("")
    fake = root / "fake"
    fake.mkdir()
    for name, body in (("python3", _PYTHON3), ("python", _PYTHON)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)

    def run(**env):
        mark = f"moe-ci-{uuid.uuid4().hex}"
        full = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "CI": "true", "MARK": mark,
                **{k: str(v) for k, v in env.items()}}
        p = subprocess.run(["bash", ".ci/run"], cwd=root, env=full, capture_output=True, text=True, timeout=120)
        # A stage's process that the run killed may take a moment to go where the stand-ins run
        # at nice 10 or 19 on a busy machine (seen in CI: one still there after 0.2 s); one the
        # run left alive lives its 60 s.
        for _ in range(100):
            left = subprocess.run(["pgrep", "-f", mark], capture_output=True, text=True).stdout.split()
            if not left:
                break
            time.sleep(0.1)
        for pid in left:
            subprocess.run(["kill", pid])
        assert not left, f"{len(left)} processes of the stages outlived the run by 10 s"
        return p.returncode, p.stdout + p.stderr, (root / f"{mark}.emulated").exists()
    return run


def test_all_stages_pass_in_order(ci):
    rc, out, emulated = ci()
    assert rc == 0 and emulated, out
    order = ["suite ran", "444 passed", "a64 build", "emulated", "xla tests"]
    assert [out.index(x) for x in order] == sorted(out.index(x) for x in order), out
    assert "FAILED" not in out and "SKIPPED" not in out


@pytest.mark.parametrize("env, verdict, rc", [
    ({"SUITE_RC": 3}, "the Quickstart test command exited with 3", 3),
    ({"SANB_RC": 1}, "the sanitizer build failed", 1),
    ({"SANT_RC": 1}, "the tests under the sanitizers failed", 1),
    ({"SANT_RC": 1, "EMU_S": 30}, "the tests under the sanitizers failed", 1),  # not waiting for the emulation
    ({"A64_RC": 1}, "the C++ modules do not build or link for aarch64", 1),
    ({"A64_RC": 2}, "CI=true, where no stage may be skipped", 1),
    ({"A64ENV_RC": 1}, "CI=true, where no stage may be skipped", 1),
    ({"EMU_RC": 1}, "the aarch64 modules fail their tests under emulation", 1),
    ({"XLAENV_RC": 1}, "CI=true, where no stage may be skipped", 1),
    ({"XLA_RC": 1}, "the XLA stage's tests failed", 1),
], ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else None)
def test_a_failed_or_missing_stage_fails_the_run(ci, env, verdict, rc):
    status, out, emulated = ci(**env)
    assert status == rc and f"CI FAILED: {verdict}" in out, out
    if env.get("EMU_S"):  # the verdict came first, and the emulation was stopped
        assert not emulated, "the run waited for the emulation after the verdict"


def test_an_emulation_that_cannot_be_set_up_is_skipped_not_failed(ci):
    """.ci/aarch64_qemu.sh exits 2 where it lacks root (binfmt_misc, a mount namespace)."""
    rc, out, _ = ci(EMU_RC=2)
    assert rc == 0 and "SKIPPED the aarch64 emulation" in out, out
