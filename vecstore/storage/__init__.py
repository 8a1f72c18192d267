"""On-disk stores: layout, durable files, the writer lock, lazy loading, verify and gc."""

from vecstore.storage.maintenance import GcReport as GcReport
from vecstore.storage.maintenance import SequenceInfo as SequenceInfo
from vecstore.storage.maintenance import StoreInfo as StoreInfo
from vecstore.storage.persistence import Persistence as Persistence
from vecstore.storage.verify import VerifyReport as VerifyReport

__all__ = ["GcReport", "Persistence", "SequenceInfo", "StoreInfo", "VerifyReport"]
