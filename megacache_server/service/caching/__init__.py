"""The cache itself: the content-addressed blobs, the entries naming them, the resolutions
and publish claims a fleet agrees on, put together as one `TenantCache` per caller
(`tenant`) by the process-wide cache (`cache`)."""
