"""``qvl encode``, the job: inputs at data-set scale to vision features in streamed, resumable shards.

The stages, one module each (none imports the command line, :mod:`qvl.vit.cli`, which parses arguments into
:class:`~qvl.vit.encode.options.EncodeOptions` and calls :func:`qvl.vit.encode.job.run`):

- :mod:`.options`: the job's options and defaults (no torch import, so ``qvl --help`` stays fast);
- :mod:`.inputs`: files, folders, lists of paths, globs and videos -> numbered inputs; decoding and video sampling;
- :mod:`.prepare`: decoded pixels -> the checkpoint's pixel values, on the device;
- :mod:`.loader`: worker processes that decode (and on a CPU prepare) inputs, videos in chunks of whole temporal
  patches, and the packing of their pieces into batches by a patch budget;
- :mod:`.invariance`: the matrix products in fixed row tiles, so that an input's features do not depend on what
  shares its batch;
- :mod:`.tower`: the checkpoint (or the embedded demo tower), device and dtype;
- :mod:`.writer`: shards written atomically as features arrive, the index, resuming, the single-file layout;
- :mod:`.progress`: the progress bar and where the time went;
- :mod:`.job`: the wiring.
"""
