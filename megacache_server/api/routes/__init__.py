"""One router per part of the v1 API; each handler reads the request, calls the tenant's
cache, and writes the answer."""
