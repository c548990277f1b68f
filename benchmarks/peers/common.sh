# Sourced by every peer script, from the repository root: where the peers are installed
# ($PEERS, default ~/.cache/dresd/peers, outside the repository) and dresd's cached default
# model live, the model itself (`make model` where it is missing), and the datastore hybrid
# runs with: $DATASTORE, by default make demo's GSM8K store where it exists ("none": without),
# as the `dresd` options STORE_ARGS.
PEERS=${PEERS:-$HOME/.cache/dresd/peers}
MODEL_DIR=${DRESD_CACHE:-$HOME/.cache/dresd}/models/SmolLM2-135M-Instruct
mkdir -p "$PEERS"
[ -x .venv/bin/dresd ] && [ -d "$MODEL_DIR" ] || make model

if [ -z "${DATASTORE+x}" ]; then
  DATASTORE=none
  [ -f runs/demo-gsm8k-id-store/manifest.json ] && DATASTORE=runs/demo-gsm8k-id-store
fi
STORE_ARGS=()
if [ "$DATASTORE" != none ]; then STORE_ARGS=(--datastore "$DATASTORE"); fi
