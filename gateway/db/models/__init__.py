"""The gateway's database schema (SQLAlchemy 2 ORM). Wire schemas live in gateway/api/.

Postgres in production, SQLite as the embedded default: only portable types are used, enums are
stored as checked strings, and timestamps are always timezone-aware UTC.

One module per group of tables; everything is importable from here.
"""

from gateway.db.models.base import (
    MAX_ROW_ID,
    NAMING_CONVENTION,
    Base,
    UTCDateTime,
    utcnow,
)
from gateway.db.models.batches import (
    BatchItem,
    BatchItemStatus,
    BatchJob,
    BatchStatus,
    FilePart,
    StoredFile,
)
from gateway.db.models.fine_tuning import (
    FINAL_FINE_TUNING_STATES,
    FineTuningCheckpoint,
    FineTuningEvent,
    FineTuningJob,
    FineTuningStatus,
)
from gateway.db.models.load import (
    LoadRollup,
    LoadSample,
)
from gateway.db.models.predictors import (
    OPEN_RETRAIN_STATES,
    PredictorVersion,
    RetrainJob,
    RetrainJobState,
)
from gateway.db.models.requests import (
    InferenceRequest,
    LengthSample,
    OffloadEvent,
    RequestStatus,
    Site,
)
from gateway.db.models.responses import StoredResponse
from gateway.db.models.scaling import ScalingEvent
from gateway.db.models.tenancy import (
    AdapterOwner,
    AdminLoginFailure,
    AdminSession,
    ApiKey,
    IdempotencyRecord,
    IdempotencyStatus,
    KeyInFlightHold,
    KeyLimitWindow,
)

__all__ = [
    "FINAL_FINE_TUNING_STATES",
    "MAX_ROW_ID",
    "NAMING_CONVENTION",
    "OPEN_RETRAIN_STATES",
    "AdapterOwner",
    "AdminLoginFailure",
    "AdminSession",
    "ApiKey",
    "Base",
    "BatchItem",
    "BatchItemStatus",
    "BatchJob",
    "BatchStatus",
    "FilePart",
    "FineTuningCheckpoint",
    "FineTuningEvent",
    "FineTuningJob",
    "FineTuningStatus",
    "IdempotencyRecord",
    "IdempotencyStatus",
    "InferenceRequest",
    "KeyInFlightHold",
    "KeyLimitWindow",
    "LengthSample",
    "LoadRollup",
    "LoadSample",
    "OffloadEvent",
    "PredictorVersion",
    "RequestStatus",
    "RetrainJob",
    "RetrainJobState",
    "ScalingEvent",
    "Site",
    "StoredFile",
    "StoredResponse",
    "UTCDateTime",
    "utcnow",
]
