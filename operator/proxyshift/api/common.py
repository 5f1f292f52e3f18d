"""Shared building blocks of the proxyshift API models.

Every model speaks Kubernetes JSON (camelCase) on the wire and snake_case in
Python; `to_k8s` is the one way to serialise for the API server.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonValue

API_GROUP = "proxyshift.io"
API_VERSION = "v1alpha1"
GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"

# Go's time.ParseDuration grammar, which is what kube-proxy and Kubernetes users write.
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
_DURATION_RE = re.compile(DURATION_PATTERN)
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str) -> timedelta:
    """Parse a Go duration string ("1m30s", "500ms") into a timedelta."""
    if not _DURATION_RE.match(text):
        raise ValueError(f"{text!r} is not a duration: use a number and a unit, like 30s, 5m or 1h30m")
    seconds = sum(float(num) * _UNIT_SECONDS[unit] for num, unit in _PART_RE.findall(text))
    return timedelta(seconds=seconds)


def _check_duration(text: str) -> str:
    parse_duration(text)
    return text


Duration = Annotated[
    str,
    AfterValidator(_check_duration),
    # The bound keeps the API server's CEL cost estimate finite for rules that read durations.
    Field(max_length=32, json_schema_extra={"pattern": DURATION_PATTERN}),
]

# Bounds of a label selector, as Kubernetes' own validation allows (qualified name: 253 prefix + / + 63).
MAX_SELECTOR_EXPRESSIONS = 32
MAX_SELECTOR_VALUES = 64
_VALUES_RULE = (
    "self.operator in ['In', 'NotIn'] ? (has(self.values) && size(self.values) > 0) : "
    "(!has(self.values) || size(self.values) == 0)"
)
_VALUES_MESSAGE = "values must be non-empty for In and NotIn, and empty for Exists and DoesNotExist"


class KubeModel(BaseModel):
    """Base of every API model: camelCase aliases, strict about unknown fields."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    # The API server prunes `field: null` (no field is nullable in our CRDs) before defaulting
    # and validation, so there null means "unset"; the models say the same. Models that must
    # keep a document's exact shape (KubeProxyConfiguration) turn this off.
    null_means_unset: ClassVar[bool] = True

    @field_validator("*", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and cls.null_means_unset and info.field_name:
            field = cls.model_fields[info.field_name]
            if not field.is_required():
                return field.get_default(call_default_factory=True)
        return value

    def to_k8s(self) -> dict[str, Any]:
        """Serialise as the API server expects: camelCase, no unset/None fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def with_rules(*rules: dict[str, str]) -> ConfigDict:
    """KubeModel's config plus the CEL rules the CRD carries for the model (x-kubernetes-validations)."""
    validations: list[JsonValue] = [dict(rule) for rule in rules]
    return ConfigDict(**KubeModel.model_config, json_schema_extra={"x-kubernetes-validations": validations})


class LabelSelectorRequirement(KubeModel):
    """One expression of a label selector, as in Kubernetes' LabelSelector."""

    model_config = with_rules({"rule": _VALUES_RULE, "message": _VALUES_MESSAGE, "fieldPath": ".values"})

    key: str = Field(max_length=317, description="The label key the selector applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the key relates to the values: In, NotIn, Exists or DoesNotExist."
    )
    values: list[Annotated[str, Field(max_length=63)]] | None = Field(
        default=None,
        max_length=MAX_SELECTOR_VALUES,
        description="Values for In and NotIn (must be non-empty); empty for Exists and DoesNotExist.",
    )

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        wants_values = self.operator in ("In", "NotIn")
        if wants_values != bool(self.values):
            raise ValueError(_VALUES_MESSAGE)
        return self


class LabelSelector(KubeModel):
    """A Kubernetes label selector. An empty selector ({}) selects every node."""

    match_labels: dict[str, str] | None = Field(
        default=None, description="Labels a node must carry, all of them (ANDed)."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None,
        max_length=MAX_SELECTOR_EXPRESSIONS,
        description="Label expressions a node must satisfy, all of them (ANDed)."
    )

    def matches(self, labels: dict[str, str]) -> bool:
        for key, value in (self.match_labels or {}).items():
            if labels.get(key) != value:
                return False
        for req in self.match_expressions or []:
            present = req.key in labels
            values = set(req.values or [])
            if req.operator == "In" and not (present and labels[req.key] in values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


class Condition(KubeModel):
    """A status condition following the Kubernetes API conventions (metav1.Condition)."""

    type: str = Field(description="Condition type: Ready, Progressing, Degraded, Paused or Conflict.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="A CamelCase machine-readable reason for the last transition.")
    message: str = Field(default="", description="A human-readable explanation of the condition.")
    last_transition_time: str = Field(
        description="When the condition last changed status (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="The spec generation the condition was computed from."
    )
