"""The one canonical schema of the store's SQLite index (:mod:`mountd.store.index` makes the
queries): every table and column, with its units, sentinels and invariants, in one place to
read (docs/store-layout.md "The index" shows the same tables).
"""

#: Bumped when the schema changes incompatibly; an index with another version is rebuilt.
SCHEMA_VERSION = 1

#: The canonical schema. Every column: units, sentinels, invariants.
SCHEMA = """
-- Key/value facts about this index.
--   schema_version: SCHEMA_VERSION as text; another value means "rebuild from the store".
--   layout_version: mountd.store.layout.LAYOUT_VERSION the store was written with.
--   clean:          "1" = written by a clean shutdown, the index matches the store exactly
--                   (open may skip the store scan); "0" (set durably at open) = owned by a
--                   running mountd or left by a crash: open reconciles with the store.
--   synced_through: entries.added stamp (ns) of the last durable checkpoint: every row added
--                   at or before it had its file on disk when that checkpoint's syncfs
--                   returned. Rows added later may name files a power cut damaged.
--   boot_id:        /proc/sys/kernel/random/boot_id of that checkpoint ("" if unknown). A
--                   crash in the same boot lost nothing the kernel had (its page cache
--                   survives a process); after a reboot recovery verifies the rows added
--                   after synced_through (docs/store-layout.md "Durability").
--   store_access:   "shared" or "private" (mountd.store.access.StoreModes.name): every folder
--                   and file of the store has those modes. Absent (a store from a quiverfs
--                   that made everything private, or a rebuilt index) or "changing" (a walk
--                   changing them was cut short): open walks the store and sets it.
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,             -- fact name (see above)
    value TEXT NOT NULL                 -- its value, as text
) WITHOUT ROWID;

-- One row per verified file in the store.
-- Invariant (after recovery): a row exists  =>  store/<hex[0:2]>/<hex[2:4]>/<hex> exists, is
-- complete and its blake3 is `hash`. Rows are inserted only after the file's rename and the
-- directory fsync, and deleted before (in the same trio step as) the file's unlink.
CREATE TABLE IF NOT EXISTS entries (
    hash     BLOB PRIMARY KEY,          -- 32-byte blake3 of the content; names the file
    size     INTEGER NOT NULL,          -- content bytes, == the file's st_size; >= 0
    last_use INTEGER NOT NULL,          -- ns since the Unix epoch of the last fill or hit; the
                                        --   LRU key; strictly increasing within one mountd run
    added    INTEGER NOT NULL,          -- ns since the Unix epoch the file was stored (or, for an
                                        --   adopted file, its mtime)
    pinned   INTEGER NOT NULL DEFAULT 0 -- 0 = evictable; 1 = never evicted (e.g. the active chunk
                                        --   of a dataset); lost (0) when the index is rebuilt
) WITHOUT ROWID;
-- Eviction scans evictable rows oldest first.
CREATE INDEX IF NOT EXISTS entries_lru ON entries (pinned, last_use, hash);

-- Which datasets use which content (the same bytes may belong to many datasets).
-- Invariant: refs.hash is in entries (rows are deleted together); lost when rebuilt.
CREATE TABLE IF NOT EXISTS refs (
    dataset TEXT NOT NULL,              -- dataset id (as given to Cache.ensure / register_dataset)
    hash    BLOB NOT NULL,              -- entries.hash
    chunk   INTEGER NOT NULL DEFAULT -1,-- the dataset's chunk holding this file; -1 = not chunked
    PRIMARY KEY (dataset, hash)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS refs_by_hash ON refs (hash);

-- Which uid each entry is charged to (the user whose request filled it: the requester of a
-- fill mountd read, the supplier of supplied bytes); the per-user quota is over these
-- (mountd/store/quota.py). Entries filled for nobody in particular (mountd's own preloads,
-- files adopted by recovery) have no row. Invariant: owners.hash is in entries (rows are
-- deleted together); lost when the index is rebuilt. A new table rather than a column of
-- entries, so an index from before quotas keeps its schema version (and is not rebuilt).
CREATE TABLE IF NOT EXISTS owners (
    hash  BLOB PRIMARY KEY,             -- entries.hash
    uid   INTEGER NOT NULL,             -- the uid charged (SO_PEERCRED of the request); >= 0
    size  INTEGER NOT NULL,             -- entries.size (the content fixes it), so the per-uid
                                        --   totals are one scan of this table at open
    stamp INTEGER NOT NULL              -- this uid's eviction queue key: a last-use stamp
                                        --   <= the entry's current last use (hits move only
                                        --   that: last_use, or a hit's stamp in memory; the
                                        --   quota's eviction re-queues an entry it finds used
                                        --   since, quota.py), or a newer stamp for an entry
                                        --   it found pinned
) WITHOUT ROWID;
-- The quota's eviction walks one uid's entries by stamp, oldest first; with size, the index
-- also covers the per-uid totals read at open (a scan of it, no table lookups).
CREATE INDEX IF NOT EXISTS owners_queue ON owners (uid, stamp, size);

-- Datasets registered by the serving side (for usage reports); a dataset may have refs
-- without being registered (e.g. after unregister_dataset, until its content is evicted).
CREATE TABLE IF NOT EXISTS datasets (
    id         TEXT PRIMARY KEY,        -- dataset id
    info       TEXT NOT NULL,           -- JSON object given to register_dataset (opaque here)
    registered INTEGER NOT NULL         -- ns since the Unix epoch of the last registration
) WITHOUT ROWID;
"""
