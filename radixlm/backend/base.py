"""What the backends share. The interface they implement is radixlm.lang.backend_api; BaseBackend
and Prompt are re-exported here because custom backends written against this module import them."""

from radixlm.lang.backend_api import BaseBackend, Prompt

__all__ = ["BackendConnectionError", "BaseBackend", "Prompt"]


class BackendConnectionError(ConnectionError):
    """The backend's server cannot be reached; the message names its URL."""
