"""qvl inside SGLang: :mod:`.plugin` (the entry point, its switch ``QVL_SGLANG`` and its model-loader hook),
:mod:`.attention` (qvl's backend in SGLang's ``VisionAttention`` layers) and :mod:`.tower` (SGLang's towers on qvl's
runner). None of them imports SGLang at import time."""
