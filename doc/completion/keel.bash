# bash completion for keel and keel-bench: subcommands and options come from the program's
# own --help (so they never drift from it), paths from the filesystem. Installed as
# share/bash-completion/completions/keel (and keel-bench, with the benchmarks).

# The options and subcommands a --help lists, one per line: "$@" is the command to ask.
_keel_listed() {
  "$@" --help 2>/dev/null | awk '
    /^Subcommands:/ { sub_ = 1; next }
    /^[^ ]/ || /^$/ { sub_ = 0; next }
    sub_ { print $1; next }
    $1 ~ /^-/ { n = split($1, o, ","); for (i = 1; i <= n; i++) if (o[i] ~ /^-/) print o[i] }'
}

_keel_offer() {  # $1: the word being completed; $2: the candidates, one per line
  local IFS=$'\n'
  COMPREPLY+=($(compgen -W "$2" -- "$1"))
}

_keel() {
  local cur=${COMP_WORDS[COMP_CWORD]} prog=${COMP_WORDS[0]}
  COMPREPLY=()
  if ((COMP_CWORD == 1)); then
    _keel_offer "$cur" "$(_keel_listed "$prog")"
    return
  fi
  local sub=${COMP_WORDS[1]}
  if [[ $prog == *keel-bench || $sub != kv ]]; then
    # keel lock, locks, fsinfo; keel-bench COMMAND: options, else paths.
    if [[ $cur == -* ]]; then
      _keel_offer "$cur" "$(_keel_listed "$prog" "$sub")"
    else
      COMPREPLY=($(compgen -f -- "$cur"))
    fi
    return
  fi
  # keel kv [OPTIONS] PATH SUBCOMMAND [ARGS]: the first word that is not an option (nor
  # --max-bytes' value) is PATH, the next the subcommand.
  local i w path="" verb="" takes_value=0
  for ((i = 2; i < COMP_CWORD; i++)); do
    w=${COMP_WORDS[i]}
    if ((takes_value)); then
      takes_value=0
    elif [[ $w == --max-bytes ]]; then
      takes_value=1
    elif [[ $w != -* ]]; then
      if [[ -z $path ]]; then path=$w; elif [[ -z $verb ]]; then verb=$w; fi
    fi
  done
  if ((takes_value)); then
    return
  elif [[ -z $path ]]; then
    if [[ $cur == -* ]]; then
      _keel_offer "$cur" "$(_keel_listed "$prog" kv | grep '^-')"
    else
      COMPREPLY=($(compgen -d -- "$cur"))
    fi
  elif [[ -z $verb ]]; then
    if [[ $cur == -* ]]; then
      _keel_offer "$cur" "$(_keel_listed "$prog" kv | grep '^-')"
    else
      _keel_offer "$cur" "$(_keel_listed "$prog" kv | grep -v '^-')"
    fi
  elif [[ $cur == -* ]]; then
    _keel_offer "$cur" "$(_keel_listed "$prog" kv "$path" "$verb")"
  else
    COMPREPLY=($(compgen -f -- "$cur"))
  fi
}

complete -F _keel keel keel-bench
