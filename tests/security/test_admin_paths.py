"""Finding 9: the load balancer's admin-path filter let `/metrics/` through (the gateway strips the
trailing slash) and was not checked against percent-encoded paths (`/%61dmin/...`, which the
gateway's server decodes to `/admin/...`); and the OpenAPI UI pages loaded third-party scripts
on the admin cookie's origin.

The listener rules are evaluated as the load balancer does (lowest priority first, wildcards `*`
and `?`, case-sensitive, path without the query) for a caller outside the operators' networks;
the gateway is asked for its UI pages through HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import httpx
import pytest

from tests.e2e.conftest import Federation
from tests.infra.hcl_eval import Evaluator, literal
from tests.infra.hcl_tree import TERRAFORM_DIR, ModuleConfig

OPERATOR_ONLY = [
    "/admin",
    "/admin/",
    "/admin/api/keys",
    "/metrics",
    "/metrics/",
    "/metrics//",
    "/%61dmin/api/keys",
    "/%2561dmin/api/keys",
    "/admin%2Fapi/keys",
    "/%6Detrics",
    "/%6detrics/",
    "/v1/../admin/api/keys".replace("..", "%2E%2E"),
]
PUBLIC = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz", "/v1/batches/b_1"]


@dataclass(frozen=True, slots=True)
class Rule:
    priority: int
    patterns: tuple[str, ...]
    from_operators_only: bool
    action: str


def listener_rules() -> list[Rule]:
    gateway = ModuleConfig.load(TERRAFORM_DIR / "modules" / "aws_gateway")
    evaluate = Evaluator(locals=gateway.locals, directory=gateway.directory).evaluate
    rules = []
    for (kind, _), block in gateway.resources.items():
        if kind != "aws_lb_listener_rule":
            continue
        patterns: tuple[str, ...] = ()
        operators_only = False
        for condition in block.children("condition"):
            for path in condition.children("path_pattern"):
                patterns = tuple(evaluate(path.attributes["values"]))
            operators_only |= bool(condition.children("source_ip"))
        action = literal(block.children("action")[0].attributes["type"])
        rules.append(Rule(literal(block.attributes["priority"]), patterns, operators_only, action))
    return sorted(rules, key=lambda rule: rule.priority)


def outcome_from_outside(rules: list[Rule], path: str) -> str:
    for rule in rules:
        if rule.from_operators_only:
            continue  # the caller is not in admin_cidrs
        if any(fnmatchcase(path, pattern) for pattern in rule.patterns):
            return rule.action
    return "forward"  # the listener's default action


@pytest.mark.parametrize("path", OPERATOR_ONLY)
def test_no_spelling_of_the_operator_surface_is_forwarded_from_outside(path: str) -> None:
    assert outcome_from_outside(listener_rules(), path) == "fixed-response", path


@pytest.mark.parametrize("path", PUBLIC)
def test_the_client_api_is_still_forwarded(path: str) -> None:
    assert outcome_from_outside(listener_rules(), path) == "forward", path


UI_PAGES = ["/schema/swagger", "/schema/redoc", "/schema/elements", "/schema/rapidoc"]


@pytest.mark.slow
def test_the_openapi_ui_pages_are_off_unless_enabled(start_federation) -> None:
    closed: Federation = start_federation(live=[], dead=("aws-use1",))
    for page in UI_PAGES:
        response = httpx.get(closed.base_url + page, timeout=10)
        assert response.status_code == 404, (page, response.text[:200])
    schema = httpx.get(f"{closed.base_url}/schema/openapi.json", timeout=10)
    assert schema.status_code == 200
    assert "/v1/completions" in schema.json()["paths"]
    opened: Federation = start_federation(
        live=[], dead=("gcp-euw4",), env={"GATEWAY_OPENAPI_UI": "true"}
    )
    assert httpx.get(opened.base_url + "/schema/swagger", timeout=10).status_code == 200
