# Shared by the GPU run scripts (sourced, not run): the Llama-3-8B-shaped checkpoint and one
# `corridor serve` in the background at a time, stopped on exit.
#   ensure_checkpoint DIR        make it with make_llama8b.py unless DIR/config.json exists
#   server_pid=$!; ...; stop_server   SIGINT, up to 60 s to finish, then SIGKILL

ensure_checkpoint() {
    if [ ! -f "$1/config.json" ]; then
        header "checkpoint $1"
        python3 scripts/gpu/make_llama8b.py "$1" --tokenizer-dir .gpu/llama3-tokenizer 2>&1 | tail -n 3
    fi
}

server_pid=
stop_server() {
    [ -n "$server_pid" ] || return 0
    kill -INT "$server_pid" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$server_pid" 2>/dev/null
    wait "$server_pid" 2>/dev/null
    server_pid=
}
trap stop_server EXIT
