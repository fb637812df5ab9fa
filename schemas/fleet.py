"""The fleet file: data centers, models, instances, tenants and class objectives.

Gateways (and the collector) learn every upstream address from this file and nowhere
else. It is TOML or JSON; ``examples/fleet.toml`` is a complete sample that tests load.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    HttpUrl,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas.base import Frozen, Identifier, TaskClass
from schemas.envelope import describe
from schemas.objectives import DEFAULT_OBJECTIVES, ClassObjective, Objectives

LOOPBACK = frozenset({"127.0.0.1", "localhost"})


EnvironmentVariable = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
"""The name of an environment variable that holds a secret: fleet files are shared and
committed, the secrets stay in each process's environment."""


class DataCenter(Frozen):
    name: Identifier
    region: Identifier


class ModelConfig(Frozen):
    name: Identifier = Field(description="The name clients put in the request's `model`.")
    profile: Identifier | None = Field(
        default=None,
        description="A calibrated step-time profile (`tokenfleet sim --help` lists them); "
        "TokenPilot needs one to price queues and prefills.",
    )
    context_tokens: int = Field(
        default=32_768,
        ge=1,
        description="The engines' `--max-model-len`: a prompt plus output budget over it has "
        "the budget shortened to fit, as vLLM does; a prompt or a budget alone over it is "
        "refused.",
    )
    version: Identifier | None = Field(
        default=None,
        description="The version requests must run on: instances of the model of other "
        "versions are never chosen, and a DC with none of this version ready is chosen only "
        "where no DC has one (its admission holds the request; unset: any version).",
    )
    rps_per_instance: float | None = Field(
        default=None,
        gt=0,
        description="Requests per second one instance serves at capacity (the operator's "
        "figure, as Google Cloud's maxRatePerInstance): the edge prices a DC's load as its "
        "requests in flight and sent lately against it (unset: its requests in flight per "
        "ready instance, and a DC with a queue counts as full).",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="The sequences each instance runs at once (the engines' "
        "`--max-num-seqs`): SLOMax keeps the interactive reserve of them free of long "
        "documents and batch (unset: it reserves KV alone).",
    )


class InstanceConfig(Frozen):
    id: Identifier
    dc: Identifier
    url: HttpUrl = Field(description="Base URL; the OpenAI API is under /v1.")
    model: Identifier

    @field_validator("url")
    @classmethod
    def _base_url(cls, url: HttpUrl) -> HttpUrl:
        """The server's base, where the gateway adds ``/v1/...`` and the collector
        ``/metrics``; a client's base URL ending in ``/v1`` (as the openai package takes
        it) reached ``/v1/v1/...`` and ``/v1/metrics``, and the instance read not ready. A
        path before it (a proxy's prefix) stays."""
        if (url.path or "").rstrip("/").endswith("/v1"):
            raise ValueError(f"{url} is the OpenAI API's URL: give the server's, without /v1")
        return url

    version: Identifier = "1"
    engine: Literal["vllm", "sglang"] = "vllm"
    api_key_env: EnvironmentVariable | None = Field(
        default=None,
        description="The environment variable holding the key the server was started with "
        "(vLLM's and SGLang's `--api-key`): gateways send it as `Authorization: Bearer`, "
        "the collector with its scrapes (unset: no key). A variable, not the key: fleet "
        "files are shared and committed.",
    )
    standby: bool = Field(
        default=False,
        description="A GPU kept for one more replica: down until FleetMind's long cycle "
        "places a replica on it (``tf.control.placement``), and down again when it takes "
        "the replica back. Gateways count it not ready until its telemetry says otherwise.",
    )

    def auth_headers(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The header a call to the server carries: its key from ``environ`` where
        ``api_key_env`` names one; ValueError where that variable is unset, so that a
        process refuses to start rather than have every call refused."""
        if self.api_key_env is None:
            return {}
        key = environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"instance {self.id}: {self.api_key_env} (its api_key_env) is unset")
        return {"authorization": f"Bearer {key}"}


ApiKey = Annotated[str, Field(min_length=1, pattern=r"^\S+$")]
"""A key clients send as ``Authorization: Bearer KEY``: no blank (an empty key matched a
header of ``Bearer`` and a space)."""
_API_KEY = TypeAdapter(ApiKey)


class TenantConfig(Frozen):
    name: Identifier
    api_keys: tuple[ApiKey, ...] = ()
    api_keys_env: tuple[EnvironmentVariable, ...] = Field(
        default=(),
        description="Environment variables each holding one more of the tenant's keys, read "
        "when a gateway starts (one unset refuses the start): keys kept out of a fleet file "
        "that is shared and committed.",
    )
    classes: tuple[TaskClass, ...] = Field(
        default=tuple(TaskClass), description="Task classes the tenant may ask for."
    )
    default_class: TaskClass | None = Field(
        default=None,
        description="The class of the tenant's requests that name none (unset: told by "
        "the request: a deadline is batch, a prompt of 16,384 tokens or more a long "
        "document, anything else interactive).",
    )
    objectives: dict[TaskClass, ClassObjective] = Field(
        default_factory=dict,
        description="The tenant's own objectives for these classes, over the fleet's.",
    )
    dcs: tuple[Identifier, ...] | None = Field(
        default=None,
        description="The DCs the tenant's requests may run in, fallback included (unset: "
        "every DC).",
    )

    @model_validator(mode="after")
    def _has_keys(self) -> TenantConfig:
        if not self.api_keys and not self.api_keys_env:
            raise ValueError(
                f"tenant {self.name!r} has neither api_keys nor api_keys_env: none of its "
                "clients could be let in"
            )
        return self

    def with_keys_from(self, environ: Mapping[str, str]) -> TenantConfig:
        """The tenant with the keys its ``api_keys_env`` names read from ``environ``;
        ValueError naming a variable that is unset or holds no valid key."""
        keys = []
        for variable in self.api_keys_env:
            try:
                keys.append(_API_KEY.validate_python(environ.get(variable, "").strip()))
            except ValidationError:
                raise ValueError(
                    f"tenant {self.name}: {variable} (in its api_keys_env) is unset, or holds "
                    "no key (one word, no blanks)"
                ) from None
        return self.model_copy(update={"api_keys": (*self.api_keys, *keys)}) if keys else self

    @model_validator(mode="after")
    def _default_allowed(self) -> TenantConfig:
        if self.default_class is not None and self.default_class not in self.classes:
            raise ValueError(
                f"tenant {self.name!r}: default_class {self.default_class.value!r} is not "
                "among its classes"
            )
        return self


class RoutingProfile(Frozen):
    """The routing policy the gateways run, and its parameters by name (checked against
    the policy's when a gateway starts; ``tokenfleet sim --help`` lists the policies)."""

    policy: Identifier = "tokenpilot"
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="The policy's parameters to change; the others keep the defaults its "
        "code ships (e.g. sglang_cache_aware: cache_threshold = 0.5).",
    )


class RoundTrip(Frozen):
    """The network between two regions, both ways."""

    regions: tuple[Identifier, Identifier]
    rtt_ms: float = Field(ge=0)


class FleetConfig(Frozen):
    version: Literal[1] = 1
    dcs: tuple[DataCenter, ...] = Field(min_length=1)
    network: tuple[RoundTrip, ...] = Field(
        default=(),
        description="Round trips between regions; pairs not named count as "
        "the DC policy's default.",
    )
    models: tuple[ModelConfig, ...] = Field(min_length=1)
    instances: tuple[InstanceConfig, ...] = Field(min_length=1)
    tenants: tuple[TenantConfig, ...] = ()
    routing: RoutingProfile = Field(default_factory=RoutingProfile)
    objectives: dict[TaskClass, ClassObjective] = Field(
        default_factory=lambda: dict(DEFAULT_OBJECTIVES),
        description="Per-class objectives; classes not named keep the defaults.",
    )

    def all_objectives(self) -> Objectives:
        """The classes' objectives with every tenant's overrides."""
        return Objectives(
            classes=self.objectives,
            tenants={t.name: t.objectives for t in self.tenants if t.objectives},
        )

    @field_validator("objectives", mode="after")
    @classmethod
    def _over_defaults(
        cls, given: dict[TaskClass, ClassObjective]
    ) -> dict[TaskClass, ClassObjective]:
        return DEFAULT_OBJECTIVES | given

    @model_validator(mode="after")
    def _references_resolve(self) -> FleetConfig:
        dcs = {d.name for d in self.dcs}
        models = {m.name for m in self.models}
        for tenant in self.tenants:
            unknown = set(tenant.dcs or ()) - dcs
            if unknown:
                raise ValueError(f"tenant {tenant.name!r} names unknown dcs {sorted(unknown)}")
        for instance in self.instances:
            if instance.dc not in dcs:
                raise ValueError(f"instance {instance.id!r} names unknown dc {instance.dc!r}")
            if instance.model not in models:
                raise ValueError(f"instance {instance.id!r} names unknown model {instance.model!r}")
        self._each_once()
        return self

    def _each_once(self) -> None:
        """ValueError for a name, or a tenant's key, that appears twice."""
        for name, items in (
            ("dc", [d.name for d in self.dcs]),
            ("model", [m.name for m in self.models]),
            ("instance", [i.id for i in self.instances]),
            ("tenant", [t.name for t in self.tenants]),
            ("API key", [k for t in self.tenants for k in t.api_keys]),
        ):
            if len(set(items)) != len(items):
                raise ValueError(f"{'an' if name[0] in 'AEIOU' else 'a'} {name} appears twice")

    def round_trips_s(self) -> dict[tuple[str, str], float]:
        """Round trips in seconds, by (region, region), both ways."""
        out: dict[tuple[str, str], float] = {}
        for trip in self.network:
            a, b = trip.regions
            out[a, b] = out[b, a] = trip.rtt_ms / 1000
        return out

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def with_tenant_keys(self, environ: Mapping[str, str]) -> FleetConfig:
        """The fleet with every tenant's keys from ``environ`` added (``api_keys_env``), as
        a gateway serves it; ValueError naming a variable that is unset, or for a key two
        tenants then share."""
        if not any(t.api_keys_env for t in self.tenants):
            return self
        keyed = self.model_copy(
            update={"tenants": tuple(t.with_keys_from(environ) for t in self.tenants)}
        )
        try:  # a key twice would let the first tenant's rules apply to the other's clients
            keyed._each_once()
        except ValueError as exc:
            raise ValueError(f"{exc}, counting the keys of the tenants' api_keys_env") from None
        return keyed

    def edge_regions(self) -> dict[str, str | None]:
        """Each DC, as an edge whose gateways choose DCs, with the region its requests
        come from (the DC's own): FleetMind's weights for it are judged on them."""
        return {dc.name: dc.region for dc in self.dcs}

    def local_instances(self, dc: str | None = None) -> list[InstanceConfig]:
        """The instances on this machine's loopback (``dc``'s alone, if given): those the
        emulator serves and ``tokenfleet up`` starts."""
        return [i for i in self.instances if i.url.host in LOOPBACK and dc in (None, i.dc)]


class FleetFileError(ValueError):
    """The fleet file cannot be read or is not a valid fleet."""


def load_fleet(path: Path) -> FleetConfig:
    """The fleet in ``path`` (``.toml`` or ``.json``), or FleetFileError saying what is wrong."""
    try:
        text = path.read_text(encoding="utf-8")  # TOML's, whatever the locale's
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        return FleetConfig.model_validate(data)
    except OSError as exc:
        raise FleetFileError(f"cannot read fleet file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise FleetFileError(f"fleet file {path} is not valid: {exc}") from None
    except UnicodeDecodeError:
        raise FleetFileError(f"fleet file {path} is not text (UTF-8)") from None
    except RecursionError:  # json's decoder: lists or tables nested thousands deep
        raise FleetFileError(f"fleet file {path} is nested too deep to be a fleet") from None
    except ValidationError as exc:
        raise FleetFileError(f"fleet file {path}: {describe(exc)}") from None
