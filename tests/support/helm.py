"""Helm for tests: `helm template` and `helm lint --strict` of a chart, run by Helm's own Go SDK (helm.sh/helm/v4) as
helm-python-sdk ships it (dev extra: a PyPI wheel bundling libhelm_c, a C ABI over that SDK). It is the chart
loader, values-schema check, template engine and linter of the helm binary: a template is an install with dry-run
"client", which is what `helm template` runs. (No helm binary: it is a Go program, and the Go module proxy is not
among the registries this project's machines and CI reach.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.paths import REPO

CHART = REPO / "deploy" / "helm" / "minivllm"


class HelmError(Exception):
    """Helm refused to render: the message is Helm's (a schema violation, a template's `fail`)."""


@dataclass
class Helm:
    version: str
    config: Any  # helm_python.Config: no cluster is contacted by a client dry-run

    def template(self, values: dict | None = None, release: str = "minivllm", chart: Path = CHART) -> list[dict]:
        """The rendered objects (`helm template RELEASE CHART -f values`); HelmError when Helm refuses."""
        from helm_python import HelmError as SdkError

        try:
            release_info = self.config.install(str(chart), release, values, dry_run="client", namespace="default")
        except SdkError as exc:
            raise HelmError(str(exc)) from exc
        return [d for d in yaml.safe_load_all(release_info["manifest"]) if d]

    def lint(self, values: dict | None = None, chart: Path = CHART) -> list[str]:
        """The errors and warnings of `helm lint --strict` (empty: it passes)."""
        import helm_python

        report = helm_python.lint(str(chart), values, strict=True)
        return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + report["errors"]


def find_helm() -> Helm | None:
    """Helm's SDK, or None when helm-python-sdk is not installed."""
    try:
        import helm_python
        from helm_python import _native
    except ImportError:
        return None
    version = f"Helm SDK {_native.helm_sdk_version()} (helm-python-sdk {_native.helm_c_version()})"
    return Helm(version, helm_python.Config())
