"""A Hugging Face dataset laid out in a local ``datasets`` cache, as a first online ``load_dataset`` leaves it, so that
``load_dataset("<org>/<name>", subset, split=...)`` finds it offline (``HF_DATASETS_CACHE`` + ``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import os
import shutil


def cache_dataset(cache_dir: str, repo_id: str, subsets: dict[str, dict[str, list[dict]]]) -> str:
    """Prepare ``{subset: {split: rows}}`` of ``repo_id`` under ``cache_dir`` (the datasets cache layout
    ``<org>___<name>/<subset>/<version>/<hash>/``); returns ``cache_dir``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    org, name = repo_id.split("/")
    build = cache_dir + "_build"
    for subset, splits in subsets.items():
        files = {}
        for split, rows in splits.items():
            path = os.path.join(build, "src", subset, f"{split}.parquet")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), path)
            files[split] = [path]
        builder = Parquet(cache_dir=build, dataset_name=name, config_name=subset, data_files=files, hash="0" * 16)
        builder.download_and_prepare()
        version, digest = builder.cache_dir.split(os.sep)[-2:]
        # what the Hub's loader would have written: the subset's name as the configuration directory
        shutil.copytree(builder.cache_dir, os.path.join(cache_dir, f"{org}___{name}", subset, version, digest))
    shutil.rmtree(build)
    return cache_dir
