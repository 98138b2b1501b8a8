"""Token shards in a local folder or GCS, and the loader that feeds each rank its micro-batches.

Modules, from the bottom up: `storage` (one small protocol, local files and GCS), `shards` (the shard
format and manifest), `tokenizers`, `prepare` (text -> shards), `sampling` (pure sample order) and
`loader` (torch; loading hosts forward data to their peers). This package imports nothing heavy at
import time: torch and the GCS client load only with the modules that need them.
"""
