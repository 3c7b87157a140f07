"""Checkpoints: megatron dist checkpoints of a model (converter output) and complete training checkpoints.

Below both convert/ and train/ (it imports neither): `justrl-convert` writes and reads model checkpoints, the training
loop saves and resumes training checkpoints, and `justrl-convert mcore-to-hf` reads either.

    weights.py   model checkpoints: weights + what wrote them (justrl_megatron.json, hf/ side files)
    folders.py   training checkpoint folders: step_N/, `latest`, staging, manifests, intact or damaged
    state.py     what a training checkpoint holds: model + optimizer state (formats), RNG, the layout it was saved at
    save.py      saving: atomic, asynchronous (Checkpointer), retention, a full disk
    load.py      resuming: the latest intact checkpoint, on every rank alike

Training checkpoints hold model, optimizer, LR schedule, RNG states, data position and step; atomic; exact resume.
"""

from .folders import (CRC_MAX_BYTES, LATEST, MANIFEST, STEP_PREFIX, STOP_STATE, TMP_PREFIX, TRAINER_STATE,
                      CheckpointError, CheckpointWriteError, checkpoint_problem, checkpoint_root, find_checkpoint,
                      fsync_path, latest_step, newest_intact_step, resume_candidates, step_dir, write_manifest)
from .load import load_latest_checkpoint
from .save import (FULL_BYTES, MARGIN, Checkpointer, commit_pending, disk_full_message, remove_stale_staging,
                   save_checkpoint, save_stop_state)
from .state import DISTOPT_METADATA, OPTIM_METADATA, layout_refusal, rng_state, set_rng_state
from .weights import (HF_SUBDIR, META_FILE, is_dist_checkpoint, layout_meta, load_model, load_model_state,
                      model_sharded_state_dict, read_meta, save_model, write_meta)
