"""Fixtures of the operator tests. They live in ``emulator_harness`` so the test modules import the
helpers by a unique module name (``conftest`` is ambiguous when tests/chart is collected too)."""

from emulator_harness import (api, crd_installed, emulator, emulator_thread, kubeconfig,  # noqa: F401
                              kubectl, operator_log, running_operator)
