# The site's own set-up (module load, conda activate), sourced by every batch script here before
# it runs Python, srun or torchrun, once per job start. Sourced, not submitted.
#
#   SITE_SETUP=FILE   the file to source (for example ~/minidist-site.sh); by default slurm/site.sh
#                     beside this file, if there is one. SITE_SETUP= (empty) sources nothing.
#
# The site file is yours: write the lines you type on a login node before `python` works, for
# example (a Princeton-style cluster; module names and versions differ from site to site, so take
# them from `module avail` and your site's documentation):
#
#   module purge
#   module load anaconda3/2024.6 cudatoolkit/12.4
#   conda activate minidist
#   export SCRATCH=/scratch/gpfs/$USER    # where the model cache goes (HF_HOME=$SCRATCH/hf)
#
# It is sourced at the top level (not in a function) with `set -eu` off, as conda's and module's
# own scripts expect; a site file that ends with an error stops the job with one line. Lesson
# scripts that hand over to chess_finetune.sh source it first themselves (lesson 00 runs Python
# before), and MINIDIST_SITE_DONE keeps chess_finetune.sh from sourcing it again in the same job.

if [[ ${MINIDIST_SITE_DONE:-} != "job ${SLURM_JOB_ID:-none}" ]]; then
    SITE_FILE=${SITE_SETUP-$(dirname "${BASH_SOURCE[0]}")/site.sh}
    if [[ -z $SITE_FILE ]]; then
        echo "site set-up: none (SITE_SETUP is empty)"
    elif [[ -f $SITE_FILE ]]; then
        echo "site set-up: sourcing $SITE_FILE"
        set +eu
        source "$SITE_FILE"
        SITE_STATUS=$?
        set -eu
        if (( SITE_STATUS != 0 )); then
            echo "error: the site set-up $SITE_FILE ended with status $SITE_STATUS: fix it, or submit with SITE_SETUP= to skip it" >&2
            exit 2
        fi
    elif [[ -n ${SITE_SETUP:-} ]]; then
        echo "error: SITE_SETUP=$SITE_SETUP is not a file: name the site set-up to source (module load, conda activate), or leave SITE_SETUP empty for none" >&2
        exit 2
    else
        echo "site set-up: none (no $SITE_FILE; SITE_SETUP=FILE names one)"
    fi
    export MINIDIST_SITE_DONE="job ${SLURM_JOB_ID:-none}"
fi
