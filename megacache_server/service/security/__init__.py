"""Who may do what and what may be believed: tokens and scopes (`auth`), the server's
signatures (`signing`), re-verifying what clients report (`trust`), who wrote each entry
(`provenance`) and the quarantine of bad blobs and unloadable entries (`quarantine`)."""
