"""``ct_session``: the session object, the model cache and its resident models, model loading,
the fixtures, and the progress of long attributions."""
