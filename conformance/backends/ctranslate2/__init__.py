"""The CTranslate2 backend (``backend.py``, entry point ``backend:backend``) and the conversion
of HF fixtures to its format (``convert.py``). Nothing is imported here, so the conversion
alone does not load the backend."""
